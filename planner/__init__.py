"""The planner: sizes the prefill and decode pools to the TTFT and ITL SLOs as load changes
(docs/planner.md). Torch-free: it reads the gateway's metrics, prices instances with the
simulator's timing model and starts and stops instance processes."""
