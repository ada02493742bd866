"""What a run stands on: exit statuses, the workdir I/O layer (local or gs://), processes
and their heartbeats, preemption, the hang watchdog, the metric writers."""
