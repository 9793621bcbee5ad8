"""bench's own small library: what its scripts share, and what the tests share with them.

The scripts run as ``python bench/NAME.py``, with bench/ on ``sys.path``, and import ``lib.X``; the tests
import ``bench.lib.X``. So each helper is written once, and bench never imports the tests: ``options`` (the
options most scripts take, as argparse parents), ``servers`` (a free port, a ``dmlsearch serve`` process
started and waited for), ``images`` (synthetic images and a small model), ``cluster`` (a real Ray cluster)
and ``hostile_images`` (the files of the fault suite and the attacks).
"""
