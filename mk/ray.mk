# Included from the Makefile: `make test-ray` runs `sweep --ray` and `demo --ray` on a real local Ray cluster
# (tests/ray_harness/ray_tests.py) and checks they give the process pool's JSON, in its own venv .venv-ray
# (ray from PyPI beside this checkout's package; tests/ray_harness/setup_venv.sh). A few minutes on 2 cores.
.PHONY: test-ray
test-ray: $(STAMP)
	bash tests/ray_harness/setup_venv.sh
	.venv-ray/bin/python -m pytest -q tests/ray_harness/ray_tests.py
