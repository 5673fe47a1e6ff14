"""Protocol buffer definitions and their generated Python modules (do not edit *_pb2*)."""
