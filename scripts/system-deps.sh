#!/usr/bin/env bash
# Debian packages Nystream uses: g++ (torch's inductor compiles one stream's musicnn push with it,
# audio/musicnn/graph.py; without it that push runs eagerly), PortAudio (libportaudio2) for the
# microphone and the X11/xcb libraries Qt's window needs; with --test also JACK (jackd2), whose dummy server gives the
# microphone tests a real, clocked PortAudio input, Xvfb for the real-window screenshot test and
# Chromium for the page's test in a real browser;
# and python3-venv where $PYTHON (default python3) cannot create a virtual environment (Debian's
# and Ubuntu's python3 without it). Installs only what is missing, with apt-get (as root, or
# through sudo -n). Where that is not possible it says what to run and carries on (files and the
# demo signal work without the others, and the microphone tests skip with a reason), except
# without venv support, where nothing can be installed: then it stops with the command to run.
set -uo pipefail
pkgs=(g++ libportaudio2 libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0 libxkbcommon-x11-0 libxcb-shape0
      libxcb-render-util0 libxcb-image0 libegl1 libfontconfig1)
[ "${1:-}" = "--test" ] && pkgs+=(jackd2 xvfb chromium)
python="${PYTHON:-python3}"
venv_ok() { "$python" -c "import ensurepip, venv" >/dev/null 2>&1; }
venv_ok || pkgs+=(python3-venv)          # Debian's and Ubuntu's python3 lack ensurepip without it
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo -n"
  if command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} ..." >&2
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null; } ||
      echo "note: could not install ${missing[*]} (run: sudo apt-get install ${missing[*]}); microphone input or the window may be unavailable" >&2
  else
    echo "note: install ${missing[*]} with your package manager (microphone input, the window)" >&2
  fi
fi
if ! venv_ok; then                       # nothing works without it: stop here, saying what to run
  echo "error: $python cannot create a virtual environment (no ensurepip); run: sudo apt-get install python3-venv, then make again" >&2
  exit 1
fi
exit 0
