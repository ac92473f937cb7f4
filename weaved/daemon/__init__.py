"""The daemon: sessions and their turns (``core``), where they run and how they move (``moves``,
``migration``, ``pools``), what survives a restart (``journal``, ``recovery``), and what it reports
(``status``, ``events``)."""
