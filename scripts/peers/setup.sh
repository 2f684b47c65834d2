#!/usr/bin/env bash
# Create one virtual environment per peer tool, outside the project's dependencies.
#
#   scripts/peers/setup.sh [pykeen] [pbg] [libkge] [pecanpy]      (default: all four)
#
# PEERS_HOME (default ~/.cache/dsa-train-peers) holds one venv per tool. torch==2.13.0 is
# installed first in each that needs torch, so pip resolves the CPU wheel and no peer pulls a
# CUDA build. PecanPy (node2vec's walks) and gensim (its skip-gram) need no torch; PecanPy pins
# numpy below 2.
# PyG's kge models need no venv of their own: torch_geometric is in the project's venv.
# A tool that fails to install leaves its log in PEERS_HOME/<tool>.log; the others go on.
set -u
PEERS_HOME="${PEERS_HOME:-$HOME/.cache/dsa-train-peers}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
mkdir -p "$PEERS_HOME"
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(pykeen pbg libkge pecanpy)

install() {  # install <tool> <torch|no-torch> <pip args...>
    local tool=$1 torch=$2; shift 2
    local venv="$PEERS_HOME/$tool"
    {
        echo "== $(date -u +%FT%TZ) $tool"
        "$PYTHON" -m venv "$venv" &&
        "$venv/bin/pip" install --quiet --upgrade pip &&
        { [ "$torch" = no-torch ] || "$venv/bin/pip" install --quiet "$TORCH_SPEC"; } &&
        "$venv/bin/pip" install --quiet "$@" &&
        echo "== ok $tool"
    } >"$PEERS_HOME/$tool.log" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then echo "$tool: installed in $venv"; else echo "$tool: FAILED (see $PEERS_HOME/$tool.log)"; fi
    return $rc
}

status=0
for tool in "${tools[@]}"; do
    case "$tool" in
        pykeen) install pykeen torch "pykeen==1.11.*" "setuptools<81" || status=1 ;;
        # torchbiggraph 1.0 imports pkg_resources, gone from setuptools 81 on.
        pbg) install pbg torch "setuptools<81" "torchbiggraph==1.0.*" || status=1 ;;
        libkge) install libkge torch libkge || status=1 ;;
        pecanpy) install pecanpy no-torch "pecanpy==2.0.*" "gensim==4.*" || status=1 ;;
        *) echo "unknown tool: $tool (known: pykeen pbg libkge pecanpy)"; status=2 ;;
    esac
done
exit $status
