#!/bin/bash
# The environment mlc runs in inside the mlc images, then the command given (`mlc-env CMD ARGS...`).
# On the Ascend image (CANN base) it sources CANN's set_env scripts first, as the CANN image's own entrypoint does;
# on the CPU and CUDA images it only runs the command. Every image's ENTRYPOINT starts with it, and cluster nodes
# start Ray through it: `docker run --entrypoint mlc-env IMAGE ray start ...` (`mlc-cli deploy nodes` prints these).
if [ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]; then
    # shellcheck disable=SC1091
    source /usr/local/Ascend/ascend-toolkit/set_env.sh
    for script in /usr/local/Ascend/cann-*/share/info/ascendnpu-ir/bin/set_env.sh; do
        if [ -f "$script" ]; then
            # shellcheck disable=SC1090
            source "$script"
        fi
    done
    if [ -f /usr/local/Ascend/nnal/atb/set_env.sh ]; then
        # shellcheck disable=SC1091
        source /usr/local/Ascend/nnal/atb/set_env.sh --cxx_abi="${ATB_CXX_ABI:-1}"
    fi
fi
exec "$@"
