"""The ``dsa-train`` command line. The only layer that prints, prompts or exits."""
