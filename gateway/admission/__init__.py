"""Admission control: tenants and API keys, per-tenant quotas (in memory or shared through Redis), a weighted fair
queue in front of the replicas' capacity gates, and fast-fail 503 when the queue cannot take more.

`AdmissionController` (controller.py) is the one object the request handler calls.
"""
