-- The schema skylift wrote before migrations existed (Base.metadata.create_all on SQLite, captured
-- from the code of that time). tests/tinker/test_postgres.py builds a database from it.
CREATE TABLE tinker_sessions (
	id VARCHAR(128) NOT NULL, 
	created_at DATETIME NOT NULL, 
	last_heartbeat DATETIME NOT NULL, 
	finished_at DATETIME, 
	finish_reason VARCHAR(64), 
	tags JSON NOT NULL, 
	user_metadata JSON NOT NULL, 
	sdk_version VARCHAR(64), 
	PRIMARY KEY (id)
);
CREATE TABLE tinker_models (
	model_id VARCHAR(256) NOT NULL, 
	session_id VARCHAR(128) NOT NULL, 
	base_model TEXT NOT NULL, 
	config JSON NOT NULL, 
	status VARCHAR(32) NOT NULL, 
	created_at DATETIME NOT NULL, 
	last_request_time DATETIME NOT NULL, 
	user_metadata JSON, 
	PRIMARY KEY (model_id)
);
CREATE INDEX ix_tinker_models_session_id ON tinker_models (session_id);
CREATE TABLE tinker_futures (
	request_id VARCHAR(64) NOT NULL, 
	kind VARCHAR(64) NOT NULL, 
	model_id VARCHAR(256), 
	dedup_key VARCHAR(512), 
	status VARCHAR(16) NOT NULL, 
	content_type VARCHAR(64), 
	result BLOB, 
	error TEXT, 
	category VARCHAR(16), 
	extra JSON, 
	created_at DATETIME NOT NULL, 
	finished_at DATETIME, 
	PRIMARY KEY (request_id), 
	UNIQUE (dedup_key)
);
CREATE INDEX ix_tinker_futures_model_id ON tinker_futures (model_id);
CREATE TABLE tinker_sampling_sessions (
	id VARCHAR(256) NOT NULL, 
	session_id VARCHAR(128) NOT NULL, 
	base_model TEXT NOT NULL, 
	model_path TEXT, 
	source VARCHAR(16) NOT NULL, 
	model_id VARCHAR(256), 
	created_at DATETIME NOT NULL, 
	PRIMARY KEY (id)
);
CREATE INDEX ix_tinker_sampling_sessions_session_id ON tinker_sampling_sessions (session_id);
CREATE TABLE tinker_checkpoints (
	id INTEGER NOT NULL, 
	tinker_path VARCHAR(768) NOT NULL, 
	model_id VARCHAR(256) NOT NULL, 
	checkpoint_id VARCHAR(512) NOT NULL, 
	kind VARCHAR(16) NOT NULL, 
	directory TEXT NOT NULL, 
	size_bytes INTEGER, 
	created_at DATETIME NOT NULL, 
	expires_at DATETIME, 
	user_metadata JSON, 
	PRIMARY KEY (id), 
	UNIQUE (tinker_path)
);
CREATE INDEX ix_tinker_checkpoints_model_id ON tinker_checkpoints (model_id);
