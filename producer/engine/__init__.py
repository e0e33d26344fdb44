"""The reference hybrid engine: vLLM's KV-cache manager, in plain Python, for demos and tests.

It stands in for vLLM wherever a real engine cannot run, and is the ground truth for what a
prefix hit is: its events are the ones vLLM would emit for the same requests, and
``hit_rule.find_longest_cache_hit`` is the rule every consumer index is checked against.
"""

from hmakv.producer.engine.cache_manager import Admission, HybridCacheManager, RequestProgress
from hmakv.producer.engine.hit_rule import find_longest_cache_hit
from hmakv.producer.engine.profiles import (
    PROFILES,
    ModelDims,
    ModelProfile,
    UnknownProfile,
    get_profile,
)

__all__ = [
    "PROFILES",
    "Admission",
    "HybridCacheManager",
    "ModelDims",
    "ModelProfile",
    "RequestProgress",
    "UnknownProfile",
    "find_longest_cache_hit",
    "get_profile",
]
