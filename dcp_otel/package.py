"""The instrumented dependency, as opentelemetry-instrumentation expects it."""

_instruments = ("torch >= 2.4",)
