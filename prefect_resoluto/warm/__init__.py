"""Warm sandboxes: started ahead of demand, restored from checkpoint images, each serving one
node (or one flow run) and then destroyed. Never imports Prefect.
"""
