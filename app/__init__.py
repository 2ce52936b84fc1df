"""moechat.app"""
