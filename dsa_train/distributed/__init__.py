"""Scale-out on ``torch.distributed``: tables sharded by rows over ranks (issue 14, in progress).

``sharding`` says which rank owns which rows; ``exchange`` moves one step's ids, rows and
gradient rows between ranks. ``optim`` stays unaware of ranks: each rank's DiskSparseAdam sees
its shard as an ordinary parameter.
"""
