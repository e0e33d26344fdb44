"""Local Kafka for tests, benchmarks and the demo: Apache Kafka (KRaft) or Tansu on loopback.

``hmakv kafka start|stop|status|fetch`` drives it from the shell; tests use the launcher directly.
"""

from hmakv.kafka.broker import (
    ApacheKafkaBroker,
    BrokerStartError,
    LocalBroker,
    TansuBroker,
    local_broker,
)
from hmakv.kafka.jars import JarFetchError, cache_dir, fetch_jars, jars_dir, kafka_version
from hmakv.kafka.probe import broker_answers
from hmakv.kafka.secured import SecuredListeners
from hmakv.kafka.state import (
    BrokerDist,
    DetachedBroker,
    StateFileError,
    StateLockError,
    default_dist,
    state_file,
    state_lock,
)
from hmakv.kafka.topics import unique_topic

__all__ = [
    "ApacheKafkaBroker",
    "BrokerDist",
    "BrokerStartError",
    "DetachedBroker",
    "JarFetchError",
    "LocalBroker",
    "SecuredListeners",
    "StateFileError",
    "StateLockError",
    "TansuBroker",
    "broker_answers",
    "cache_dir",
    "default_dist",
    "fetch_jars",
    "jars_dir",
    "kafka_version",
    "local_broker",
    "state_file",
    "state_lock",
    "unique_topic",
]
