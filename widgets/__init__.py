"""moechat.widgets"""
