"""Every sandbox setting, declared once (:mod:`.fields`), turned into a runtime and a conduit
(:mod:`.config`) and shown as block and work-pool fields (:mod:`.forms`). Never imports Prefect.
"""
