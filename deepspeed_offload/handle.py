"""Where an engine keeps its offload handle: the ground floor that the API, the runtime and the
integrations all read, so that none of them imports another for it."""

HANDLE_ATTR = "_deepspeed_offload"


def get_handle(engine):
    """The stream/compile mode object attached to ``engine`` (stats, counters), or None."""
    return getattr(engine, HANDLE_ATTR, None)
