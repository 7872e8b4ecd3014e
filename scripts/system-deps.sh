#!/usr/bin/env bash
# Debian packages Nystream uses: g++ (torch's inductor compiles one stream's musicnn push with it,
# audio/musicnn/graph.py; without it that push runs eagerly), PortAudio (libportaudio2) for the
# microphone and the X11/xcb libraries Qt's window needs; with --test also JACK (jackd2), whose dummy server gives the
# microphone tests a real, clocked PortAudio input, and Xvfb for the real-window screenshot test.
# Installs only what is missing, with apt-get (as root, or through sudo). Where that is not
# possible it says what to install and carries on: files and the demo signal work without it,
# and the microphone tests skip with a reason.
set -uo pipefail
pkgs=(g++ libportaudio2 libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0 libxkbcommon-x11-0 libxcb-shape0
      libxcb-render-util0 libxcb-image0 libegl1 libfontconfig1)
[ "${1:-}" = "--test" ] && pkgs+=(jackd2 xvfb)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "note: install ${missing[*]} with your package manager (microphone input, the window)" >&2; exit 0
fi
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo -n"
echo "installing ${missing[*]} ..." >&2
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null; }; then
  echo "note: could not install ${missing[*]}; microphone input or the window may be unavailable" >&2
fi
exit 0
