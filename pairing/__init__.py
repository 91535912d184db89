"""draftsmith.pairing"""
