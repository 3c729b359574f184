#!/usr/bin/env bash
# Creates the harness's virtual environments under $ANCHORS (default /tmp/anchors; never inside the repository).
# usage (from the repository root): bash benchmarks/anchors/setup.sh [fedflat|flwr|pfl|blazefl ...]
#   (default: all four). Logs: $ANCHORS/logs/setup-*.log
# env: FEDFLAT_SRC  the local fedflat git repository to install (default: the repository this harness lies in,
#                   `git -C benchmarks/anchors rev-parse --show-toplevel`); its committed HEAD is cloned to $ANCHORS/fedflat and
#                   installed from there, so nothing is written into the repository (uncommitted changes are not
#                   installed)
#      PYTHON       the interpreter of the venvs (default python3.11)
#      ANCHORS      where everything goes (default /tmp/anchors)
# Each framework gets its own venv because their pins conflict (fedflat[ray] pins ray==2.55.1,
# flwr 1.42 its own ray; pfl/blazefl have their own numpy/torch ranges). torch is 2.13.0 (CPU) in all.
set -u
A=${ANCHORS:-/tmp/anchors}
PY=${PYTHON:-python3.11}
HERE=$(cd "$(dirname "$0")" && pwd)
FEDFLAT_SRC=${FEDFLAT_SRC:-$(git -C "$HERE" rev-parse --show-toplevel 2>/dev/null)}
NICE="nice -n 19"
which=${*:-fedflat flwr pfl blazefl}

case " $which " in
  *" fedflat "*)
    if [ -z "$FEDFLAT_SRC" ] || ! git -C "$FEDFLAT_SRC" rev-parse --verify -q HEAD >/dev/null; then
      echo "setup.sh: run the copy in a fedflat clone (or set FEDFLAT_SRC to one): '${FEDFLAT_SRC:-$HERE}'" \
           "is not a git repository with a commit" >&2
      exit 1
    fi
    FEDFLAT_SRC=$(cd "$FEDFLAT_SRC" && pwd) ;;
esac
mkdir -p "$A/logs"

mkvenv() {  # name
  local v="$A/venv-$1"
  if [ ! -x "$v/bin/python" ]; then $PY -m venv "$v"; fi
  $NICE "$v/bin/pip" install -q --upgrade pip wheel >/dev/null
  $NICE "$v/bin/pip" install -q torch==2.13.0 numpy
}

for w in $which; do
  log="$A/logs/setup-$w.log"
  (
    set -x
    case $w in
      fedflat)
        # fedflat is installed from a clone of the repository's HEAD, so that nothing is written into the
        # repository (an editable install would put its egg-info there).
        if [ ! -d "$A/fedflat/.git" ]; then
          git clone -q "$FEDFLAT_SRC" "$A/fedflat"
        else
          git -C "$A/fedflat" fetch -q "$FEDFLAT_SRC" HEAD && git -C "$A/fedflat" checkout -q -f --detach FETCH_HEAD
        fi
        git -C "$A/fedflat" log --oneline -1
        mkvenv fedflat
        # [ray] only (not [dev]: dev adds flwr 1.41, wandb, mlflow, datasets, none of which the bench needs)
        $NICE "$A/venv-fedflat/bin/pip" install -q -e "$A/fedflat[ray]" ;;
      flwr)
        mkvenv flwr
        $NICE "$A/venv-flwr/bin/pip" install -q 'flwr[simulation]==1.42.0' ;;
      pfl)
        mkvenv pfl
        $NICE "$A/venv-pfl/bin/pip" install -q 'pfl[pytorch]==0.6.0' || $NICE "$A/venv-pfl/bin/pip" install -q 'pfl==0.6.0' ;;
      blazefl)
        # blazefl 3.0.0 declares Requires-Python >= 3.14: installed on $PY without its Python check, then
        # backported (syntax only: backport_blazefl.py). Its deps: torch, tqdm, numpy.
        mkvenv blazefl
        $NICE "$A/venv-blazefl/bin/pip" install -q --no-deps --ignore-requires-python 'blazefl==3.0.0' tqdm
        site=$("$A/venv-blazefl/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        "$A/venv-blazefl/bin/python" "$HERE/backport_blazefl.py" "$site/blazefl"
        "$A/venv-blazefl/bin/python" -c 'import blazefl.contrib, blazefl.core; print("blazefl imports")' ;;
      *) echo "unknown venv $w" ;;
    esac
    echo "SETUP-DONE $w rc=$?"
  ) >"$log" 2>&1 &
done
wait
for w in $which; do grep -v 'WARNING: Location' "$A/logs/setup-$w.log" | tail -n 3 | sed "s/^/[$w] /"; done
# the W1 problem file every runner reads (fedflat's own W1: data, Dirichlet split, the clients of every round);
# delete $A/w1 to export it again (e.g. after W1 changed in fedflat)
if [ -x "$A/venv-fedflat/bin/python" ] && [ ! -f "$A/w1/meta.json" ]; then
  PYTHONDONTWRITEBYTECODE=1 $NICE "$A/venv-fedflat/bin/python" "$HERE/export_w1.py" --out "$A/w1"
fi
