#!/usr/bin/env bash
# Build the docs site and take headless-browser screenshots of the pages whose layout once broke
# (option keys split mid-word in tables, code samples running past the column, whole signatures in
# the right-hand contents). Look at the PNGs to check a layout change in docs/stylesheets/extra.css
# or mkdocs.yml.
#
#   scripts/docs_screenshot.sh [OUT_DIR] [PAGE ...]     default: site-shots/, pages api quickstart errors reference
#
# Needs the docs tools (pip install -e '.[docs]') and Debian's chromium (apt-get install -y chromium).
# WIDTH and HEIGHT (default 1280 x 1600) set the window, i.e. what a laptop screen shows.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-site-shots}
shift || true
pages=("$@")
[ ${#pages[@]} -gt 0 ] || pages=(api quickstart errors reference)
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=${PYTHON:-.venv/bin/python}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
  echo "no chromium: apt-get install -y chromium (Debian), then run again" >&2
  exit 2
fi
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
NO_MKDOCS_2_WARNING=1 "$python" -m mkdocs build --strict --quiet --site-dir "$site"
mkdir -p "$out"
for page in "${pages[@]}"; do
  # --no-sandbox: CI and containers run as root; the page is our own static HTML.
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size="${WIDTH:-1280},${HEIGHT:-1600}" --screenshot="$out/$page.png" \
    "file://$site/$page/index.html" >/dev/null 2>&1
  echo "$out/$page.png"
done
