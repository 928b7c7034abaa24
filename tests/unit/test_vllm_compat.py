"""The vLLM version check: the connector's hooks against vLLM's base class, without an engine.

The fakes are class objects built from vLLM's real base class with one hook taken away or declared
differently: what is tested is the checker, against the real signatures it must accept."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from tpcache.integrations.vllm.compat import (  # noqa: E402
    NAMES,
    TESTED_VERSIONS,
    Name,
    VllmVersionError,
    check_vllm,
    hook_problems,
    vllm_version,
)
from tpcache.integrations.vllm.logs import LOGGER  # noqa: E402


def fake_base(drop: str = "", **replace: object) -> type:
    """vLLM's base class as a new class object, without ``drop`` and with ``replace``'s members."""
    members = {k: v for k, v in vars(KVConnectorBase_V1).items() if k not in (drop, "__dict__", "__weakref__")}
    members.update(replace)
    return type("KVConnectorBase_V1", (), members)


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler, logger = Keep(logging.WARNING), logging.getLogger(LOGGER)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def test_the_installed_vllm_has_every_hook_and_is_a_tested_version(warnings: list[str]) -> None:
    assert hook_problems(KVConnectorBase_V1) == []
    assert check_vllm() == vllm_version()
    assert vllm_version() in TESTED_VERSIONS
    assert warnings == []


def test_a_missing_hook_is_refused_in_one_line_naming_it_and_the_version() -> None:
    with pytest.raises(VllmVersionError) as info:
        check_vllm(fake_base("wait_for_layer_load"), version="9.9.9")
    message = str(info.value)
    assert "\n" not in message
    assert "KVConnectorBase_V1.wait_for_layer_load" in message and "vLLM 9.9.9" in message, message
    assert TESTED_VERSIONS[0] in message


def test_a_hook_declared_with_other_parameters_is_refused() -> None:
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, stream, **kwargs):  # noqa: ANN001, ANN202
        return None

    problems = hook_problems(fake_base(save_kv_layer=save_kv_layer))
    assert problems == [
        "declares KVConnectorBase_V1.save_kv_layer(layer_name, kv_layer, attn_metadata, stream, **kwargs), "
        "not (layer_name, kv_layer, attn_metadata, **kwargs)"
    ]
    with pytest.raises(VllmVersionError, match="save_kv_layer"):
        check_vllm(fake_base(save_kv_layer=save_kv_layer), version=vllm_version())


def test_a_missing_class_or_field_is_refused() -> None:
    gone = (*NAMES, Name("vllm.v1.outputs", "KVConnectorOutput.no_such_field", field=True))
    with pytest.raises(VllmVersionError, match=r"has no KVConnectorOutput\.no_such_field"):
        check_vllm(KVConnectorBase_V1, names=gone, version=vllm_version())
    gone = (Name("vllm.v1.metrics.cache_hit_source", "CacheHitSource.TAPE"),)
    with pytest.raises(VllmVersionError, match=r"has no CacheHitSource\.TAPE"):
        check_vllm(KVConnectorBase_V1, names=gone, version=vllm_version())


def test_an_untested_version_that_has_every_hook_starts_with_one_warning(warnings: list[str]) -> None:
    assert check_vllm(fake_base(), version="9.9.9") == "9.9.9"
    assert len(warnings) == 1 and "vLLM 9.9.9 is not a version the connector was tested on" in warnings[0]
