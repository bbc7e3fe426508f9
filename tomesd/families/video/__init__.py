"""Video denoisers, one module per family or close group (a lineage and the families built on its blocks)."""
