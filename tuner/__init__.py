"""moechat.tuner"""
