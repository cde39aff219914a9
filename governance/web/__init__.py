"""The web UI for admins, approvers and auditors: server-rendered Django views.

Views are thin: check the role, parse a strict form, call the same service the
API calls (which writes the audit event), render. Templates live in
templates/ui/, the stylesheet and the one small script in governance/static/ui/.
"""
