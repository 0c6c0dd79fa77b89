#!/usr/bin/env bash
# Fills ./.whl with the Python 3.12 x86-64 wheels that a bare CUDA image (PyTorch, Lightning, timm and the
# scientific stack already there, no package registry) lacks to run scripts/gpu_check.sh: pydantic,
# deepspeed, dvclive and what they require, tabm, rtdl_num_embeddings, and for the text transformer
# (train.text_model) transformers, tokenizers and peft at the project's pins with what they need at a newer
# version than such an image has (accelerate, huggingface_hub 2 with hf_xet and httpx2, regex, safetensors).
# Run it here, where the registry is reachable, then carry ./.whl to the GPU machine; gpu_check.sh installs
# it offline into /tmp/site, first on PYTHONPATH.
#
#   bash scripts/gpu_wheels.sh        # ~45 MiB; keep .whl out of git (echo /.whl/ >> .git/info/exclude)
#
# The versions are the lock's (requirements.lock) where the project pins them. deepspeed and
# antlr4-python3-runtime publish only source archives: they are built here into pure-python wheels.
# A wheel of another version of the same package left in .whl by an earlier pin would stop the install
# there (two versions of one package): remove .whl first when a pin changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude

BINARY=(
  aiohttp_retry==2.9.1 amqp==5.4.2 annotated_types==0.8.0 appdirs==1.4.4 asyncssh==2.24.1 atpublic==9.0.0
  billiard==4.3.2 celery==5.7.0 cffi==2.1.1 click_didyoumean==0.3.1 click_plugins==1.1.1.2 click_repl==0.4.1
  configobj==5.0.9 cryptography==50.0.2 dictdiffer==0.10.0 diskcache==5.6.3 distro==1.9.0 dpath==2.2.0
  dulwich==1.2.21 dvc==3.67.1 dvc_data==3.18.3 dvc_http==2.32.0 dvc_objects==5.2.0 dvc_render==1.0.2
  dvc_studio_client==0.23.0 dvc_task==0.40.2 dvclive==3.49.1 entrypoints==0.4.2 flatten_dict==0.5.0
  flufl_lock==9.2.0 funcy==2.1 gitdb==4.0.12 gitpython==3.2.1 grandalf==0.8 gto==1.10.1 hjson==3.1.0
  hydra_core==1.3.8 iterative_telemetry==0.0.10 kombu==5.7.0 omegaconf==2.3.1 orjson==3.13.0
  platformdirs==4.14.9 prompt_toolkit==3.0.53 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5
  pydantic_settings==2.16.3 pydot==4.0.1 pygit2==1.21.0 pygtrie==2.6.2 python_dotenv==1.2.4
  rtdl_num_embeddings==0.0.12 ruamel_yaml==0.19.1 scmrepo==3.6.2 semver==3.1.2 shortuuid==1.0.13
  shtab==1.13.0 smmap==5.0.3 sqltrie==0.11.3 tabm==0.0.3 tomlkit==0.15.2 typing_extensions==4.15.0
  typing_inspection==0.4.5 tzlocal==5.4.5 vine==5.1.0 voluptuous==0.16.0 wcwidth==0.9.4 zc_lockfile==4.0
  # train.text_model: transformers imports huggingface_hub, which imports httpx2 (and truststore) at once
  accelerate==1.16.0 hf_xet==1.8.0 httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 peft==0.21.2
  regex==2026.11.19 safetensors==0.8.0 tokenizers==0.23.3 transformers==5.23.0 truststore==0.10.5
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${BINARY[@]}"
# the CUDA accelerator's build (its metadata then requires nvidia-ml-py, which the image has); no ops are
# prebuilt (DS_BUILD_OPS=0): the project's optimizer is torch's
DS_ACCELERATOR=cuda DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation \
  -w .whl deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
echo "$(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl"
