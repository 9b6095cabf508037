"""Speculation: updates computed in backward, committed bit for bit once DeepSpeed has the norm.
``updates.py`` moves each sub-group's speculation (final, updated, committed or discarded),
``members.py`` picks who speculates and with which rollback, ``records.py`` holds what one update
keeps to be committed or rolled back."""
