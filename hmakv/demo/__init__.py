"""``hmakv demo``: the whole pipeline on one machine, checked while it runs.

It starts a broker, reference engines, the bridge and the index as the subprocesses a user would
deploy (their own ``hmakv`` commands, on free loopback ports), drives them with a router-like
probe client that compares the index's answers with the engines' real prefix hits, shows live
progress, and ends with a summary (JSON too) and a report with plots.

Modules: ``config`` (what runs), ``processes`` (process groups, logs, shutdown), ``promtext``
(reading /metrics), ``client`` (HTTP to engines and index), ``probe`` (the agreement check and
routing), ``monitor`` (periodic samples and rates), ``live`` (the progress view),
``comparison`` (the routed prompts replayed behind every router of ``hmakv.routing``),
``summary``, ``report`` and ``run`` (the orchestration).
"""
