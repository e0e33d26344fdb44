"""Secured listeners for the Apache test broker: SSL, and SASL_SSL with SCRAM-SHA-512 users.

hmakv's clients speak SSL and SASL (``kvlog/kafka_client.py``); only a real broker that demands
them shows that the settings reach every client and that a refusal reads as one. The broker's
identity comes as PEM files, which Kafka 4 reads as they are (``ssl.keystore.type=PEM``): no
keytool, no JKS passwords. SCRAM users are created by Kafka's own storage tool when it formats
a new KRaft log dir, so they exist before the broker takes its first connection.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SCRAM_MECHANISM = "SCRAM-SHA-512"
# The storage tool reads a user as ``[name=N,password=P]``: these would end a value early.
_SCRAM_SYNTAX = frozenset(',[]="')


@dataclass(frozen=True)
class SecuredListeners:
    """What a broker needs to listen with SSL (and SASL_SSL, when there are ``scram_users``).

    ``keystore``: a PEM file with the broker's private key (unencrypted PKCS#8) and its
    certificate chain. ``truststore``: a PEM file of the CA certificates it trusts, which the
    readiness probe trusts as well. ``scram_users``: SCRAM-SHA-512 name and password of each user
    the SASL_SSL listener lets in; given only to a broker whose storage is not formatted yet (a
    reused data dir keeps the users it was formatted with).
    """

    keystore: Path
    truststore: Path
    scram_users: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        """Refuse a name or password the storage tool would misread, rather than create a
        different user than the caller asked for."""
        for name, password in self.scram_users.items():
            if not name or not password or _SCRAM_SYNTAX & set(name + password):
                raise ValueError(
                    f"SCRAM user {name!r}: name and password must be non-empty and free of "
                    f"{''.join(sorted(_SCRAM_SYNTAX))}"
                )

    def server_settings(self) -> dict[str, str]:
        """The TLS and SASL lines of ``server.properties``; the listeners are the broker's.

        Paths are made absolute here, in the caller's directory: the broker runs in its data dir.
        """
        settings = {
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.keystore.absolute()),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.truststore.absolute()),
        }
        if self.scram_users:
            mechanism = SCRAM_MECHANISM.lower()
            settings["sasl.enabled.mechanisms"] = SCRAM_MECHANISM
            settings[f"listener.name.sasl_ssl.{mechanism}.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            )
        return settings

    def storage_arguments(self) -> list[str]:
        """``--add-scram`` for each user, for ``kafka-storage format``."""
        arguments = []
        for name, password in self.scram_users.items():
            arguments += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},password={password}]"]
        return arguments
