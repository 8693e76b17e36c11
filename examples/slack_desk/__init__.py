"""Approvals in Slack, end to end, offline: the desk, the real ``slack_sdk`` and a local stand-in for Slack's Web API.

``python -m examples.slack_desk [--reject] [--db PATH]``
"""
