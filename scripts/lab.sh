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
# The URL JupyterLab prints (LabApp.default_url) opens the quickstart itself.
# shellcheck disable=SC2086 # one option a word, none holds a space
exec "$jupyter" lab $options --LabApp.default_url=/lab/tree/01_quickstart.ipynb "$@" notebooks/01_quickstart.ipynb
