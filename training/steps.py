PRETRAIN_STEPS: list = []
