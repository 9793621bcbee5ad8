"""Imported only by the decode pool's forkserver (``engine.decode.pool.PRELOAD``): it ignores SIGTERM.

The forkserver starts the decode workers and reports their exit codes: when it dies, every worker it
started looks dead to its pool (exit code 255), decodes under way included, and no worker can start. A stop
of the whole process group (systemd's stop) must let those decodes finish (``foundation.stopping``), so the
forkserver ignores SIGTERM as it already ignores SIGINT. It still exits with its owner: it ends when its
owner's end closes the pipe it watches. (Its workers reset SIGTERM: ``obey_stop_signals_from_owner``.)
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
