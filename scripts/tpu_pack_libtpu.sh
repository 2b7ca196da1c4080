#!/usr/bin/env bash
# The libtpu that qarray's pinned jax asks for (jax[tpu]'s pin), cut into
# parts for a lent TPU host whose own libtpu is older than that jax (its
# libtpu refuses jax 0.12's Mosaic modules, so qarray's Pallas kernels would
# not compile there). Run after shared/tools/tpu/pack.sh; on the host, after
# the runtime's parts are staged, each .tpu/libtpu/part-K/stage.sh unpacks
# its piece, the last one the wheel into the runtime; then commands take it
# by TPU_LIBRARY_PATH (docs/accelerators.md, "Commands on the chip"):
#
#   scripts/tpu_pack_libtpu.sh [PYTHON]
#   bash .tpu/run/run.sh env TPU_LIBRARY_PATH=/tmp/qarray-rt/site/libtpu/libtpu.so CMD
set -euo pipefail
python=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
[ -d .tpu/run ] || { echo "tpu_pack_libtpu: run shared/tools/tpu/pack.sh first" >&2; exit 2; }
pin=$("$python" - <<'PY'
import importlib.metadata as m
print(next(r.split(";")[0].strip() for r in m.requires("jax") if r.startswith("libtpu")))
PY
)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  -d "$work" "$pin" 2>&1 | grep -v '^WARNING' || true
wheel=$(ls "$work"/libtpu-*.whl)
out=.tpu/libtpu; rm -rf "$out"; mkdir -p "$out"
split -b "${TPU_PART_BYTES:-45000000}" -d -a 1 "$wheel" "$work/piece."
n=$(ls "$work"/piece.* | wc -l); sum=$(md5sum < "$wheel" | cut -d' ' -f1); i=0
for piece in "$work"/piece.*; do
  i=$((i + 1)); mkdir -p "$out/part-$i"; mv "$piece" "$out/part-$i/piece"
  cat > "$out/part-$i/stage.sh" <<STAGE
#!/usr/bin/env bash
# On the TPU host, after the runtime's parts: piece $i of $n of $(basename "$wheel")
set -euo pipefail
stage=/tmp/libtpu-stage; site=/tmp/qarray-rt/site
mkdir -p "\$stage"; cp "\$(dirname "\$0")/piece" "\$stage/piece.$((i - 1))"
have=\$(ls "\$stage"/piece.* | wc -l)
if [ "\$have" -lt $n ]; then echo "libtpu: piece $i of $n kept (\$have here)"; exit 0; fi
cat \$(ls "\$stage"/piece.* | sort -V) > "\$stage/libtpu.whl"
[ "\$(md5sum < "\$stage/libtpu.whl" | cut -d' ' -f1)" = "$sum" ] || { echo "libtpu: pieces do not match"; rm -rf "\$stage"; exit 1; }
[ -d "\$site" ] || { echo "libtpu: stage the runtime's parts first"; exit 3; }
/tmp/qarray-rt/python/bin/python3.12 -m zipfile -e "\$stage/libtpu.whl" "\$site/"; rm -rf "\$stage"
echo "libtpu: ready, TPU_LIBRARY_PATH=\$site/libtpu/libtpu.so"
STAGE
  chmod +x "$out/part-$i/stage.sh"
done
echo "tpu_pack_libtpu: $pin in $n parts under $out (part-1 .. part-$n)"
