"""What this machine keeps for prefect-resoluto: its cache and state directories, process
identity, and the one shape of a "can this be used here?" answer.
"""
