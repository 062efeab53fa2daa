"""dcp-otel's monitoring mixin: Prometheus rules and alerts, and Grafana dashboards, as code.

One :class:`~mixin.config.MixinConfig` drives everything, as in
kubernetes-mixin; the generated files are committed, and a test checks they
are up to date. Regenerate after changing the code or to tune thresholds::

    python -m mixin                           # rewrite exporters/prometheus/rules/*.yml and grafana/dashboards/*.json
    python -m mixin --no-save-window 2h       # the same, with your thresholds
    python -m mixin --check                   # exit 1 if a committed file differs

Needs the ``mixin`` extra (``pip install -e .[mixin]``): grafana-foundation-sdk
pinned to its Grafana 11.6 target, and PyYAML.
"""
