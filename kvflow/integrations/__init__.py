"""Serving engines on kvflow. Each integration is imported on its own (``kvflow.integrations.vllm``)
and needs its engine installed (``pip install 'kvflow[vllm]'``); ``import kvflow`` imports none."""
