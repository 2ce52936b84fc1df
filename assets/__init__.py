"""moechat.assets"""
