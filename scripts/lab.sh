#!/bin/sh
# `make lab`: JupyterLab on the quickstart, on a laptop or a headless machine,
# as a normal user or as root (containers, CI).
#
#   scripts/lab.sh [JupyterLab options...]     e.g. --ServerApp.port=8890
#   scripts/lab.sh --print-options             the options it would add, one a line
#
# JUPYTER names the jupyter executable (default .venv/bin/jupyter). Options
# given on the command line come after the defaults, so they win.
set -eu

# The options this machine needs, one a line.
lab_options() {
    # JupyterLab refuses to start as root without --allow-root.
    if [ "${LAB_UID:-$(id -u)}" = 0 ]; then
        echo "--allow-root"
    fi
    # No display (ssh, container, CI): no browser to open; JupyterLab still
    # prints the URL with its token.
    if [ -z "${DISPLAY:-}" ] && [ -z "${WAYLAND_DISPLAY:-}" ] && [ "$(uname -s)" != Darwin ]; then
        echo "--no-browser"
    fi
    # Only this machine can connect; from elsewhere: ssh -L 8888:127.0.0.1:8888 host
    echo "--ServerApp.ip=127.0.0.1"
}

if [ "${1:-}" = "--print-options" ]; then
    lab_options
    exit 0
fi

cd "$(dirname "$0")/.."
jupyter=${JUPYTER:-.venv/bin/jupyter}
options=$(lab_options)
echo "make lab: starting JupyterLab ($jupyter lab $(echo $options)); open the URL with ?token= it prints below:" >&2
echo "          it opens the quickstart." >&2
case " $(echo $options) " in
    *" --no-browser "*)
        echo "make lab: no display here: open that URL in a browser on this machine, or from yours after" >&2
        echo "          ssh -L 8888:127.0.0.1:8888 <this host>   (use the port the URL shows)" >&2 ;;
esac
# The tutorials' kernel is the project's python3 spec (jupyter/kernels, the one
# the notebook tests use): ipykernel with --IPKernelApp.capture_fd_output=False,
# so what TensorFlow's C++ runtime writes to stderr at start-up (absl, oneDNN,
# CUDA probing: TF_CPP_MIN_LOG_LEVEL does not silence all of it) comes to this
# terminal instead of into the first cell. It is installed as the venv's python3
# kernel, so a `jupyter lab` started from the venv by hand gets it too; in a
# venv this user cannot write, this server alone reads it from jupyter/.
kernel=jupyter/kernels/python3
if said=$("$jupyter" kernelspec install --sys-prefix --name python3 "$kernel" 2>&1 >/dev/null); then
    echo "make lab: tutorials run in the kernel from $kernel (TensorFlow's C++ start-up lines come here)" >&2
else
    echo "make lab: could not install $kernel in the venv ($(echo "$said" | tail -n 1));" >&2
    echo "          this server reads it from $kernel" >&2
    JUPYTER_PATH=$PWD/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
    export JUPYTER_PATH
fi
# The URL JupyterLab prints (LabApp.default_url) opens the quickstart itself.
# shellcheck disable=SC2086 # one option a word, none holds a space
exec "$jupyter" lab $options --LabApp.default_url=/lab/tree/01_quickstart.ipynb "$@" notebooks/01_quickstart.ipynb
