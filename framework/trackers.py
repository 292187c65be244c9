"""The experiment trackers ``report_to`` may name (accelerate's) and the modules that provide each: config checks
the names, the report checks the packages are installed."""

TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
                    "comet_ml": ("comet_ml",), "aim": ("aim",), "clearml": ("clearml",), "dvclive": ("dvclive",),
                    "swanlab": ("swanlab",), "trackio": ("trackio",)}
