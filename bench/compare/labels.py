"""The supervisors bench.compare sets side by side, as its rows name them (and its results are
keyed)."""

# labels of the rows (and keys of the results)
ENGINED = "engined (echo engine)"
FLOOR = "floor (sleeping child)"
FLOOR_ECHO = "floor (echo engine child)"
SV = "supervisord (child output piped, its default)"
SV_NOPIPE = "supervisord (child stdio → /dev/null)"
SV_ECHO = "supervisord (echo engine child, output piped)"
CIRCUS = "circus (default check_delay: 5 s)"
CIRCUS_FAST = "circus (check_delay = 0.1 s)"
PEER_ROWS = (SV, SV_ECHO, SV_NOPIPE, CIRCUS, CIRCUS_FAST)
