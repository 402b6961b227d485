"""The on-disk format, shared by the writer and every reader: the record's fields and
spellings (``schema``), a sealed segment's metadata (``segment``), Arrow tables of records
(``records``), the journal's frames (``journal``), what a writer lived (``life``) and samples
(``sample``). docs/format.md is its contract."""
