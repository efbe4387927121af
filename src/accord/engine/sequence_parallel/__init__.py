"""engine.sequence_parallel"""
