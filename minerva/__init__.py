from minerva.errors import MinervaError
