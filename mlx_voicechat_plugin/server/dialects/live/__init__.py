"""OpenAI's GPT-Live protocol, at ``/openai/v1/live/sessions``: :mod:`.dialect`
(:class:`~.dialect.LiveDialect`), the session configuration (:mod:`.config`), the
session timeline's events (:mod:`.timeline`) and the delegations (:mod:`.delegations`).
"""
