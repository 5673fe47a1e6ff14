"""Protocol buffer definitions (*.proto) and their generated Python modules.

Never edit the *_pb2* files: change a .proto and run `python scripts/gen_protos.py`.
"""
