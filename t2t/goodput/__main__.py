"""python -m t2t.goodput WORKDIR [--json] [--process=N]: the report (t2t/goodput/report.py)."""

from t2t.goodput import report

report.main()
