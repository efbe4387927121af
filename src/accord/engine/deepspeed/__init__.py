"""engine.deepspeed"""
