# Source this on the lent GPU machine, from the repository root: installs the carried wheels (.whl/,
# see bench/README.md) into /tmp and sets the environment the benchmarks and GPU tests expect.
# fla goes into its own folder so that a process can run without it (the torch-fallback comparison).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/zarr-* .whl/numcodecs-* .whl/donfig-* .whl/google_crc32c-* .whl/crc32c-* .whl/msgspec-* \
    .whl/accelerate-* .whl/psutil-* .whl/pyyaml-* || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/fla_core-* .whl/flash_linear* || return 1
ln -sfn "$PWD/cli" /tmp/site/dflash_cli  # the dflash_cli import name, without installing the package
export PYTHONPATH="/tmp/site:/tmp/fla:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TQDM_MININTERVAL=30
