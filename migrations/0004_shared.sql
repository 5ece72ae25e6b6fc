-- snapstore schema v4: sessions that fit chats. See docs/format.md (snapshots.shared, §8.1).
-- 1: the snapshot was used outside its own session (restored by another session or by a caller
-- without one, or the same state saved again under another session or none). When its session
-- supersedes it, it is detached from the session (session set to NULL, kept matchable and
-- LRU-evictable) instead of dropped. 0: only its own session is known to have used it.
ALTER TABLE snapshots ADD COLUMN shared INTEGER NOT NULL DEFAULT 0;
