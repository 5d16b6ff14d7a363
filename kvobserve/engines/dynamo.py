"""NVIDIA Dynamo: a deployment of engines whose workers republish their KV events on Dynamo's event
plane (NATS or ZMQ direct), read by their own ingest (sources/dynamo_*.py, docs/dynamo.md).
Versions are those of ai-dynamo-runtime, whose bytes are in tests/fixtures/dynamo-captures."""

from __future__ import annotations

from kvobserve.engines.profile import EngineProfile, WireVersion

_STORED = ("parent_hash", "start_position", "blocks")
_REMOVED = ("block_hashes",)

PROFILE = EngineProfile(
    name="dynamo",
    title="Dynamo",
    event_plane=True,
    default_namespace="dynamo",
    # its workers run vLLM, SGLang or TensorRT-LLM, whose eviction the event plane does not say
    eviction="the backend engine's (not named on the event plane)",
    versions=(
        WireVersion(
            "0.7.1", "JSON RouterEvent on JetStream (`…-kv-events.queue`)",
            stored=("parent_hash", "blocks"), removed=_REMOVED, replay="none", hashes=("uint64",),
            captures=("dynamo-captures/0.7.1",), note="the relay stamps the engine seq as event_id",
        ),
        WireVersion(
            "1.2.1", "envelope + one RouterEvent (component scope), or JSON on JetStream",
            stored=_STORED, removed=_REMOVED, replay="none", hashes=("uint64",),
            captures=("dynamo-captures/1.2.1",),
        ),
        WireVersion(
            "1.6.1", "envelope + RouterEvent array (endpoint scope), NATS or ZMQ direct",
            stored=_STORED, removed=_REMOVED, replay="none", hashes=("uint64",),
            captures=("dynamo-captures/1.6.1",),
        ),
    ),
)  # fmt: skip
