import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_HOME", os.path.join(os.path.dirname(__file__), "..", ".keras-home"))
